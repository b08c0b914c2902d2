"""Resume with the training, and SIGKILLs at random steps of a watched training.

A training is killed (SIGKILL) at a random step, a few trials in a row: its file opens, holds
every step up to what /progress says and nothing half written, and the training resumed from
its own last checkpoint appends from the checkpoint's step: no step twice, none missing, the
statistics those of the training never killed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import pandas as pd
import torch

import probe
from probe.store.runfile import open_probe_file
from probe.train.log_lines import steps_text
from tests.helpers import ROOT
from tests.train.watched_training import main

STEPS = 12
TRIALS = 3


def reference(tmp_path) -> pd.DataFrame:
    """The training never killed, in this process: its train.csv."""
    main(tmp_path / "ref", tmp_path / "ref.pt", STEPS)
    return pd.read_csv(tmp_path / "ref" / "train.csv")


def killed_at(out, checkpoint, step: int) -> str:
    """Run the training in a subprocess and SIGKILL it once it printed `step <step>`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.train.watched_training", str(out), str(checkpoint),
         str(STEPS), "0.05"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.strip() == f"step {step}":
            proc.send_signal(signal.SIGKILL)
            break
    seen.append(proc.stdout.read())
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return "".join(seen)


def test_sigkills_at_random_steps_then_a_resume_from_the_checkpoint(tmp_path):
    ref = reference(tmp_path)
    assert sorted(ref["step"].unique()) == list(range(STEPS))
    with probe.open_run(tmp_path / "ref") as run:
        ref_scalars = run.train_scalars()
    rng = random.Random(41)
    for trial in range(TRIALS):
        out, ckpt = tmp_path / f"t{trial}", tmp_path / f"t{trial}.pt"
        printed = killed_at(out, ckpt, rng.randrange(1, STEPS - 1))
        done = max(int(s.split()[1]) for s in printed.split("\n") if s.startswith("step")) + 1
        with open_probe_file(out / "probe.h5") as f:  # opens, killed with it in SWMR mode
            progress = f["progress"][()]
            valid = int(progress["steps"])
            held = list(f["train/step"][:valid])
            assert not progress["complete"]
        assert held == list(range(valid))  # every step up to /progress, in order
        assert held == [] or int(progress["last_step"]) == held[-1]
        assert done - valid <= 2  # at most flush_every steps lost
        with probe.open_run(out) as run:  # what a reader sees: those steps, as never killed
            table = run.train()
        expected = ref[ref["step"] < valid].reset_index(drop=True)
        pd.testing.assert_frame_equal(table, expected, check_dtype=False, rtol=1e-9)

        resumed_at = torch.load(ckpt, weights_only=True)["watch"]["step"] if ckpt.exists() else 0
        assert resumed_at <= valid  # (the checkpoint's state_dict flushed the file)
        main(out, ckpt, STEPS)  # resumed in this process, from the training's own checkpoint
        if resumed_at:  # the log says what the resume kept and what it cut
            log = (out / "probe.log").read_text()
            said = f"resuming the training at step {resumed_at}: kept {resumed_at} recorded"
            assert said in log
            cut = [s for s in held if s >= resumed_at]
            if cut:
                word = "steps" if len(cut) > 1 else "step"
                assert f"cut {word} {steps_text(cut)}, recorded after the checkpoint" in log
        table = pd.read_csv(out / "train.csv")  # every step once, in order; as never killed
        pd.testing.assert_frame_equal(table, ref, check_dtype=False, rtol=1e-9)
        with probe.open_run(out) as run:
            assert run.complete
            pd.testing.assert_frame_equal(run.train(), ref, check_dtype=False, rtol=1e-9)
            pd.testing.assert_frame_equal(run.train_scalars(), ref_scalars, rtol=1e-9)
