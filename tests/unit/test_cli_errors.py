"""Whatever a user types, the CLI answers with a result or one line and exit code 2 — never a traceback."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gaudi3_scale.cli.main import main

_KEYS = ["--model.num_layers", "--model.dim", "--train.max_steps", "--train.precision", "--optim.lr",
         "--train.micro_batch_size", "--data.val_fraction", "--model.arch", "--nope", "--train", "-x", "--"]  # fmt: skip
_VALUES = st.sampled_from(
    ["3", "-1", "0", "1e-3", "nan", "true", "[1, 2]", "{a: 1}", "", "gpt", "bf16-mixed"]
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(st.sampled_from(_KEYS) | _VALUES | st.text(max_size=8), max_size=6))
def test_fuzzed_train_flags_exit_0_or_2_with_one_line(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        main(["train", "--print-config", *args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    assert code in (0, 2), (args, code, err)
    if code == 2:
        assert err.startswith("gaudi3: error: ") and err.count("\n") == 1, (args, err)
