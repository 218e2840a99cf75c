"""tests/notebook_kernels.py: a notebook's kernel that never answers is examined, reported and replaced once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

import notebook_kernels

# A kernel that stays silent (alive, never answering) while a marker file says so, else a real ipykernel.
SILENT_THEN_REAL = """\
import os, runpy, sys, time
marker = {marker!r}
if os.path.exists(marker):
    if {once!r}:
        os.remove(marker)
    while True:
        time.sleep(1)  # the silent kernel waits here
sys.argv = ["ipykernel_launcher", *sys.argv[1:]]
runpy.run_module("ipykernel_launcher", run_name="__main__")
"""


class OneSpec(KernelSpecManager):
    def __init__(self, argv: list[str], **kwargs):
        super().__init__(**kwargs)
        self.spec = KernelSpec(argv=argv, display_name="test", language="python")

    def get_kernel_spec(self, kernel_name):
        return self.spec


def silent_kernel(tmp_path: Path, once: bool) -> OneSpec:
    marker = tmp_path / "stay-silent"
    marker.touch()
    script = tmp_path / "silent_kernel.py"
    script.write_text(SILENT_THEN_REAL.format(marker=str(marker), once=once))
    return OneSpec([sys.executable, str(script), "-f", "{connection_file}"])


def test_a_silent_kernel_is_reported_with_its_stack_and_a_fresh_one_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(notebook_kernels, "FIRST_TRY_S", 3)
    with pytest.warns(RuntimeWarning, match="did not answer within 3 s; a fresh kernel was started") as caught:
        km, kc = notebook_kernels.start_kernel(startup_timeout=120, spec_manager=silent_kernel(tmp_path, once=True))
    try:
        reply = kc.execute_interactive("x = 6 * 7", timeout=60)
        assert reply["content"]["status"] == "ok", reply
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    report = str(caught[0].message)
    assert "Kernel didn't respond" in report and "CPU" in report, report
    # faulthandler's dump of the silent kernel: the line it was waiting on
    assert "silent_kernel.py" in report and "Current thread" in report, report


def test_two_silent_kernels_in_a_row_fail_with_both_reports(tmp_path):
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="two kernels in a row did not answer") as raised:
        notebook_kernels.start_kernel(startup_timeout=3, spec_manager=silent_kernel(tmp_path, once=False))
    message = str(raised.value)
    assert message.count("silent_kernel.py") >= 2 and "The second:" in message, message
