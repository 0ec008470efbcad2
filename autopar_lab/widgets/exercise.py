"""Predict, try, check: the notebooks' exercises.

A learner writes down a prediction before running the cells that compute the answer, then checks it. Two layers:

- :func:`check_answer` compares a prediction with the answer the library computes and returns a :class:`Verdict`
  (right or not yet, with a hint). Plain Python: no Jupyter import, so the headless notebook test exercises it.
- :class:`Exercise` wraps it for the live notebook: the question, an input box pre-filled with the notebook's
  default prediction and a Check button (ipywidgets, imported only when the box is first displayed).

In a notebook::

    my_prediction = 1.0                                   # edit, or type in the box below and press Check
    ask = Exercise("Backward FLOPs / forward FLOPs?", default=my_prediction, hint="...")
    ask                                                   # the box
    ...                                                   # the cells that compute `ratio`
    ask.check(ratio)                                      # the verdict (run headless, it checks the default)

>>> check_answer(2, 1.996, rel_tol=0.1).correct
True
>>> print(check_answer("tensor", "data", choices=("data", "tensor", "replicated"), hint="Count the bytes."))
✘ Not yet: you predicted tensor; the answer is data. Hint: Count the bytes.
"""

from __future__ import annotations

import html
import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Verdict", "check_answer", "Exercise"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check: ``correct``, and the ``message`` a learner reads (right/not yet, and a hint)."""

    correct: bool
    message: str

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:  # a notebook cell ending in a check shows the message, not the dataclass
        return self.message

    def _repr_html_(self) -> str:
        colour = "#1B5E20" if self.correct else "#B00020"
        return f"<div style='color:{colour}'>{html.escape(self.message)}</div>"


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _as_number(value: Any) -> float | None:
    """A number from a number or a text a learner typed ("2", "1e-3", " 0.5 ", "25%"); None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        text = value.strip().replace(",", "").replace("_", "")
        scale = 1.0
        if text.endswith("%"):
            text, scale = text[:-1], 0.01
        try:
            return float(text) * scale
        except ValueError:
            return None
    return None


def _then(prefix: str, text: str) -> str:
    return f"{prefix}{text}" if text else ""


def _norm(text: Any) -> str:
    return " ".join(str(text).split()).casefold()


def _check_tolerances(rel_tol: float, abs_tol: float) -> None:
    if not all(isinstance(t, numbers.Real) and math.isfinite(t) and t >= 0 for t in (rel_tol, abs_tol)):
        raise ValueError(f"rel_tol and abs_tol must be finite numbers >= 0, got {rel_tol!r} and {abs_tol!r}; "
                         "use e.g. rel_tol=0.1 for 10%.")


def check_answer(prediction: Any, expected: Any, *, rel_tol: float = 0.1, abs_tol: float = 0.0,
                 choices: Sequence[str] | None = None, hint: str = "", explain: str = "", unit: str = "") -> Verdict:
    """Compare a learner's ``prediction`` with the ``expected`` answer.

    Numbers (``expected`` a real number): right when ``|prediction - expected| <= max(rel_tol * |expected|,
    abs_tol)``; the prediction may be a number or a text such as ``"2"``, ``"1e-3"`` or ``"25%"``. Words
    (``expected`` a string): right when equal ignoring case and spacing; with ``choices`` a prediction that is not
    one of them is refused with the list. ``hint`` is shown when the prediction is not right, ``explain`` when it is;
    ``unit`` follows the numbers in the message.

    >>> check_answer("25%", 0.24, rel_tol=0.1).correct
    True
    >>> check_answer(None, 3.0).message
    'No prediction yet: write one down first (a number), then check.'
    """
    _check_tolerances(rel_tol, abs_tol)
    suffix = f" {unit}" if unit else ""
    if isinstance(expected, str):
        options = [str(c) for c in choices] if choices else None
        if prediction is None or not str(prediction).strip():
            return Verdict(False, "No prediction yet: write one down first"
                           + (f" (one of: {', '.join(options)})" if options else "") + ", then check.")
        if options and _norm(prediction) not in {_norm(c) for c in options}:
            return Verdict(False, f"{str(prediction).strip()!r} is not one of the choices; answer one of: "
                                  f"{', '.join(options)}.")
        said_text, truth_text = str(prediction).strip(), str(expected).strip()
        if _norm(said_text) == _norm(truth_text):
            return Verdict(True, f"✔ Right: you predicted {said_text}; the answer is {truth_text}."
                           + _then(" ", explain))
        return Verdict(False, f"✘ Not yet: you predicted {said_text}; the answer is {truth_text}."
                       + _then(" Hint: ", hint))
    truth = _as_number(expected)
    if truth is None or not math.isfinite(truth):
        raise ValueError(f"expected must be a finite number or a string, got {expected!r}.")
    if prediction is None or (isinstance(prediction, str) and not prediction.strip()):
        return Verdict(False, "No prediction yet: write one down first (a number), then check.")
    said = _as_number(prediction)
    if said is None or not math.isfinite(said):
        return Verdict(False, f"{prediction!r} is not a number; enter one such as 2, 0.5 or 1e-3.")
    tol = max(rel_tol * abs(truth), abs_tol)
    within = f"within {rel_tol:.0%}" if tol == rel_tol * abs(truth) and rel_tol else f"within {_fmt(tol)}{suffix}"
    if abs(said - truth) <= tol * (1 + 1e-9):  # 2.2 is within 10% of 2.0, float rounding aside
        return Verdict(True, f"✔ Right: you predicted {_fmt(said)}{suffix}; the answer is {_fmt(truth)}{suffix} "
                             f"({within})." + _then(" ", explain))
    side = "high" if said > truth else "low"
    return Verdict(False, f"✘ Not yet: you predicted {_fmt(said)}{suffix}; the answer is {_fmt(truth)}{suffix} "
                          f"(too {side}; right means {within})." + _then(" Hint: ", hint))


class Exercise:
    """One prediction exercise: a question, a prediction box and a Check button.

    ``default`` is the prediction the notebook stores (so it runs top to bottom headless); what the learner types in
    the box replaces it. ``answer``: the expected value, or a function of no arguments that computes it (called when
    Check is pressed, so it may read variables that later cells define); :meth:`check` can also be given the answer.
    The other keywords are :func:`check_answer`'s.

    >>> ex = Exercise("Backward FLOPs / forward FLOPs?", default=1.0, hint="Each matmul has two gradients.")
    >>> ex.value
    1.0
    >>> ex.check(1.996).correct
    False
    """

    def __init__(self, question: str, *, default: Any = None, answer: Any = None, rel_tol: float = 0.1,
                 abs_tol: float = 0.0, choices: Sequence[str] | None = None, hint: str = "", explain: str = "",
                 unit: str = ""):
        if not isinstance(question, str) or not question.strip():
            raise ValueError("an Exercise needs a question: give it a non-empty string.")
        self.question = question
        self.default = default
        self.answer = answer
        self.options = dict(rel_tol=rel_tol, abs_tol=abs_tol, choices=tuple(choices) if choices else None, hint=hint,
                            explain=explain, unit=unit)
        _check_tolerances(rel_tol, abs_tol)  # a bad tolerance fails here, not at the learner's first check
        self._box = self._result = None
        self._widget = None

    @property
    def value(self) -> Any:
        """The prediction: what is in the box once it is shown and edited, else the default."""
        if self._box is not None and str(self._box.value).strip():
            return self._box.value
        return self.default

    def _expected(self, answer: Any) -> Any:
        source = self.answer if answer is None else answer
        if source is None:
            raise LookupError("no answer yet: run the cells below that compute it, then check")
        return source() if callable(source) else source

    def check(self, answer: Any = None) -> Verdict:
        """The verdict on :attr:`value`; ``answer`` (the expected value) is remembered for the Check button."""
        if answer is not None:
            self.answer = answer
        verdict = check_answer(self.value, self._expected(None), **self.options)  # type: ignore[arg-type]
        if self._result is not None:
            self._result.value = verdict._repr_html_()
        return verdict

    def _on_click(self, _button=None) -> None:
        try:
            self.check()
        except (LookupError, NameError):  # the cells that compute the answer have not run yet
            if self._result is not None:
                self._result.value = ("<i>No answer yet: run the cells below that compute it, then press Check "
                                      "again.</i>")

    @property
    def widget(self):
        """The ipywidgets box (built on first use): question, prediction box, Check button, verdict."""
        if self._widget is None:
            import ipywidgets as w  # only here: the module imports without Jupyter

            choices = self.options["choices"]
            placeholder = "one of: " + ", ".join(choices) if choices else "a number"
            self._box = w.Text(value="" if self.default is None else str(self.default), placeholder=placeholder,
                               description="Prediction:", layout=w.Layout(width="320px"))
            button = w.Button(description="Check", button_style="primary", layout=w.Layout(width="90px"))
            button.on_click(self._on_click)
            self._result = w.HTML("")
            self._widget = w.VBox([w.HTML(f"<b>Predict.</b> {html.escape(self.question)}"),
                                   w.HBox([self._box, button]), self._result])
            self._widget.add_class("autopar-exercise")
        return self._widget

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        return f"Exercise({self.question!r}, prediction={self.value!r})"
