"""The notebooks' predict-try-check exercises: the plain check, and the widget's box and button."""

import subprocess
import sys

import pytest

from autopar_lab.widgets.exercise import Exercise, Verdict, check_answer


@pytest.mark.parametrize("prediction, right", [(2.0, True), ("2", True), (1.8, True), (2.2, True), (1.79, False),
                                               (2.21, False), ("1e1", False), (0, False)])
def test_numbers_are_right_within_the_relative_tolerance(prediction, right):
    assert check_answer(prediction, 2.0, rel_tol=0.1).correct is right


def test_absolute_tolerance_covers_answers_near_zero():
    assert check_answer(0.004, 0.0, abs_tol=0.01).correct
    assert not check_answer(0.02, 0.0, abs_tol=0.01).correct
    assert not check_answer(0.004, 0.0).correct          # no abs_tol: a relative band around 0 is empty


def test_percent_text_is_a_fraction():
    assert check_answer("25%", 0.25, rel_tol=0.01).correct
    assert not check_answer("25", 0.25, rel_tol=0.01).correct


def test_wrong_answer_gives_the_hint_and_the_direction():
    v = check_answer(1.0, 2.0, rel_tol=0.1, hint="Each matmul has two gradients.", unit="x")
    assert not v.correct
    assert "Hint: Each matmul has two gradients." in v.message and "too low" in v.message and "1 x" in v.message
    assert "too high" in check_answer(3.0, 2.0).message


def test_right_answer_gives_the_explanation_not_the_hint():
    v = check_answer(2.0, 2.0, hint="HINT", explain="EXPLAIN")
    assert v.correct and "EXPLAIN" in v.message and "HINT" not in v.message


def test_words_ignore_case_and_spacing_and_check_the_choices():
    opts = ("data", "tensor", "replicated")
    assert check_answer("  Data ", "data", choices=opts).correct
    assert not check_answer("tensor", "data", choices=opts, hint="h").correct
    v = check_answer("pipeline", "data", choices=opts)
    assert not v.correct and "data, tensor, replicated" in v.message
    assert check_answer("slower", "Slower").correct                  # no choices: any word, compared loosely


@pytest.mark.parametrize("prediction", [None, "", "   "])
def test_missing_prediction_asks_for_one(prediction):
    v = check_answer(prediction, 1.0)
    assert not v.correct and v.message.startswith("No prediction yet")
    assert not check_answer(prediction, "data", choices=("data", "tensor")).correct


def test_a_non_number_is_refused_with_what_to_enter():
    v = check_answer("about two", 2.0)
    assert not v.correct and "is not a number" in v.message


@pytest.mark.parametrize("kw", [dict(rel_tol=-0.1), dict(abs_tol=float("nan")), dict(rel_tol="10%")])
def test_bad_tolerances_are_one_clear_error(kw):
    with pytest.raises(ValueError, match="rel_tol and abs_tol"):
        check_answer(1.0, 1.0, **kw)
    with pytest.raises(ValueError, match="rel_tol and abs_tol"):
        Exercise("q?", **kw)


def test_expected_must_be_a_number_or_a_word():
    with pytest.raises(ValueError, match="expected must be"):
        check_answer(1.0, [1, 2])


def test_verdict_shows_its_message():
    v = Verdict(True, "✔ Right")
    assert str(v) == repr(v) == "✔ Right" and "color" in v._repr_html_()


def test_exercise_checks_its_default_and_remembers_the_answer():
    ex = Exercise("Backward / forward FLOPs?", default=1.0, rel_tol=0.1)
    assert ex.value == 1.0
    with pytest.raises(LookupError):
        ex.check()                                       # no answer given yet
    assert not ex.check(2.0).correct
    assert ex.answer == 2.0 and not ex.check().correct   # remembered


def test_exercise_answer_may_be_computed_when_checked():
    state = {}
    ex = Exercise("q?", default=3, answer=lambda: state["x"])
    state["x"] = 3.1
    assert ex.check().correct


def test_exercise_needs_a_question():
    with pytest.raises(ValueError, match="question"):
        Exercise("  ")


def test_widget_box_and_check_button():
    ex = Exercise("Backward / forward FLOPs?", default=1.0, hint="two gradients")
    box = ex.widget
    text, button = box.children[1].children
    result = box.children[2]
    assert text.value == "1.0" and "autopar-exercise" in box._dom_classes
    button.click()                                       # before the answer's cells ran
    assert "No answer yet" in result.value
    ex.answer = 2.0
    button.click()
    assert "Not yet" in result.value and "two gradients" in result.value
    text.value = "2"                                     # the learner types a new prediction
    assert ex.value == "2"
    button.click()
    assert "Right" in result.value
    assert ex.check().correct                            # the plain check reads the box too


def test_widget_with_choices_has_them_as_placeholder():
    ex = Exercise("Which wins?", default="tensor", choices=("data", "tensor"), answer="data")
    text = ex.widget.children[1].children[0]
    assert "data, tensor" in text.placeholder
    assert not ex.check().correct


def test_the_check_imports_no_jupyter():
    code = ("import sys; from autopar_lab.widgets.exercise import check_answer, Exercise; "
            "check_answer(1, 1); Exercise('q?', default=1).check(1); "
            "assert 'ipywidgets' not in sys.modules and 'IPython' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_course_reaches_it_from_the_package():
    """A notebook asks with `al.Exercise`, the package's public name, not through the widgets' module."""
    import autopar_lab as al

    v = al.Exercise("Two?", default=2.0, rel_tol=0.1).check(2.05)
    assert al.Exercise is Exercise and isinstance(v, Verdict) and v.correct
