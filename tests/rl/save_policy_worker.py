"""One process of the two-process ``save_policy`` test (torchrun, gloo on the CPU).

Argv: OUT BLOCKED GOOD. Saves a policy under BLOCKED, where the main process cannot
write, then under GOOD; each process writes what each save gave to OUT-<rank>.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    out, blocked, good = sys.argv[1:4]
    from kz_stream.rl.trainer import CoderLearner, LearnerConfig
    from kz_stream.testing.tiny import tiny_model, tiny_tokenizer

    cfg = LearnerConfig(lora_r=8, lora_alpha=16, output_dir=tempfile.mkdtemp(prefix="kz-"),
                        bf16=False, grpo_overrides={"use_cpu": True})
    learner = CoderLearner(cfg, model=tiny_model(), tokenizer=tiny_tokenizer())
    outcomes = []
    for target in (blocked, good):
        try:
            learner.save_policy(target)
            outcomes.append("saved")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    rank = learner.trainer.accelerator.process_index
    Path(f"{out}-{rank}.json").write_text(json.dumps(outcomes))
    # Leave together and close the process group, as the learner service does: exiting
    # with gloo's threads alive aborted a process now and then ("terminate called without
    # an active exception", exit -6; CI, 2026-12-04).
    learner.trainer.accelerator.wait_for_everyone()
    learner.close()


if __name__ == "__main__":
    main()
