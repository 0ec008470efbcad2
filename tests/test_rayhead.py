"""The embedded Ray head's start settings (autopar_lab.runtime.rayhead), without starting Ray: the ports it chooses,
the environment it gives Ray's processes, and the agent port file it writes for the raylet. A head started with them
is checked in tests/test_ray_lifecycle.py."""

from __future__ import annotations

import socket

from autopar_lab.runtime.rayhead import HEAD_ENV_DEFAULTS, announce_agent_listen_port, head_args, head_env


def _flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, args)
    return values[0]


def test_head_args_choose_every_agent_port_and_start_no_dashboard_nor_monitors(tmp_path):
    args = head_args(40000, str(tmp_path / "ray"), num_cpus=2, object_store_memory=10**8)
    assert args[:3] == ["start", "--head", "--block"]
    assert _flag(args, "port") == "40000" and _flag(args, "node-ip-address") == "127.0.0.1"
    assert _flag(args, "include-dashboard") == "false" and "--no-monitor" in args
    assert _flag(args, "include-log-monitor") == "false"
    assert _flag(args, "num-cpus") == "2" and _flag(args, "object-store-memory") == str(10**8)
    ports = [int(_flag(args, n)) for n in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                           "metrics-export-port", "runtime-env-agent-port")]
    assert all(p > 0 for p in ports) and not set(ports) & {52365, 10001, 8265}  # none of Ray's fixed defaults
    assert not [a for a in args if a.startswith("--ray-client-server-port")]  # no Ray Client server to place
    for p in ports:  # free when chosen
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_head_env_adds_longer_waits_but_keeps_what_the_caller_set():
    env = head_env({"RAY_AUTH_MODE": "token", "RAY_ADDRESS": "10.0.0.1:6379", "RAY_agent_register_timeout_ms": "5"})
    assert env["RAY_AUTH_MODE"] == "token" and "RAY_ADDRESS" not in env  # a new head, authentication as given
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert env["RAY_agent_register_timeout_ms"] == "5"  # the caller's own setting wins
    assert env["RAY_gcs_server_port_wait_time_s"] == HEAD_ENV_DEFAULTS["RAY_gcs_server_port_wait_time_s"]
    assert env["RAY_enable_metrics_collection"] == "0"
    assert "RAY_AUTH_MODE" not in head_env({})  # never switched on or off here


def test_the_agent_port_file_is_written_once_the_gcs_names_the_node(tmp_path):
    ray_dir = tmp_path / "ray"
    assert announce_agent_listen_port(str(ray_dir), 41234) is False  # no session yet
    session = ray_dir / "session_2026-12-07_05-00-00_1"
    session.mkdir(parents=True)
    (ray_dir / "session_latest").symlink_to(session)
    assert announce_agent_listen_port(str(ray_dir), 41234) is False  # the GCS has not named the node
    (session / "gcs_server_port_abc123").write_text("6379")
    assert announce_agent_listen_port(str(ray_dir), 41234) is True
    assert (session / "dashboard_agent_listen_port_abc123").read_text() == "41234"
    assert sorted(p.name for p in session.iterdir()) == ["dashboard_agent_listen_port_abc123",
                                                          "gcs_server_port_abc123"]  # no temporary file left
    (session / "dashboard_agent_listen_port_abc123").write_text("-1")  # the agent's own word stands
    assert announce_agent_listen_port(str(ray_dir), 41234) is True
    assert (session / "dashboard_agent_listen_port_abc123").read_text() == "-1"
