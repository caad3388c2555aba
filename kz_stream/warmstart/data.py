"""``kz warmstart data``: synthesized modules, teacher kernels and the two SFT sets.

Steps, each resumable (run the command again with the same folder to go on):

1. ``synthesize_suite``: draw ``count`` modules, validate each as a proposal is validated
   (``validate_module``: APIs, a sandboxed run, admission), and write the valid ones as a
   KernelBench-format suite, split by source hash into ``train/`` and ``heldout/``.
   ``modules.jsonl`` lists every module with its split, kind and validation result.
2. The teacher as an evaluation policy (``kz eval run train/ --policy teacher``): every
   teacher kernel is stored and judged by the project's verifier like any model's kernel.
3. ``write_sft_sets``: the Coder set is exported from the store (the correct teacher kernel
   per module, in the Coder's real prompt format); the Proposer set pairs each valid
   training module's API set with its source, in the Proposer's prompt format.

``kz warmstart proposer-data`` adds a second suite for the Proposer alone
(``synthesize_suite(..., teachable=False)``, in ``proposer/``, listed in
``proposer_modules.jsonl``): modules for API sets the teacher cannot lower, validated the
same way; ``write_proposer_sft`` takes both suites' training modules.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kz_stream.modules import fence_code, proposer_messages, validate_module
from kz_stream.warmstart.synth import Synthesizer, SynthModule, is_held_out
from kz_stream.warmstart.teacher import TeacherError, lower

__all__ = [
    "CODER_SFT",
    "MANIFEST",
    "PROPOSER_MANIFEST",
    "PROPOSER_SFT",
    "SftSets",
    "SuiteSummary",
    "sft_example",
    "synthesize_suite",
    "teacher_run_id",
    "twins_in_training",
    "write_proposer_sft",
    "write_sft_sets",
]

MANIFEST = "modules.jsonl"
PROPOSER_MANIFEST = "proposer_modules.jsonl"
_TRAIN_SPLITS = ("train", "proposer")
CODER_SFT = "coder_sft.jsonl"
PROPOSER_SFT = "proposer_sft.jsonl"


@dataclass(frozen=True)
class SuiteSummary:
    modules: int
    valid: int
    train: int
    held_out: int
    invalid_reasons: dict[str, int]


_NUMBER = re.compile(r"\b\d+(?:\.\d+)?(?:e-?\d+)?\b")


def twins_in_training(held_out: Sequence[str], train: Sequence[str]) -> list[bool]:
    """For each held-out module's source, whether a training module is its twin: the same
    source up to its number literals (sizes, constants), or one the teacher answers with
    the same kernel. The split by source hash (``is_held_out``) lets such twins fall on
    both sides (of seed 0's 800 modules, 77 of the 106 valid held-out ones have one): a
    held-out figure over twins measures the recall of answers SFT was trained on."""
    skeletons = {_NUMBER.sub("N", src) for src in train}
    answers = set()
    for src in train:
        with contextlib.suppress(TeacherError):
            answers.add(lower(src))

    def twin(src: str) -> bool:
        if _NUMBER.sub("N", src) in skeletons:
            return True
        try:
            return lower(src) in answers
        except TeacherError:
            return False

    return [twin(src) for src in held_out]


TEACHER_RUN_FILE = "teacher_run_id"


def teacher_run_id(out: Path) -> str:
    """The teacher's evaluation run id for a data folder, kept in the folder
    (``TEACHER_RUN_FILE``) once made, so a rerun resumes it wherever the folder has moved
    (a new id at another path judged every teacher kernel again, and the SFT sets read
    only the new run). A folder without the file gets the id its path gave until then."""
    import hashlib

    kept = out / TEACHER_RUN_FILE
    if kept.exists():
        return kept.read_text().strip()
    run_id = "eval-teacher-" + hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:10]
    out.mkdir(parents=True, exist_ok=True)
    kept.write_text(run_id + "\n")
    return run_id


def _file_name(index: int, module: SynthModule) -> str:
    short = "_".join(a.rsplit(".", 1)[-1] for a in module.api_set)
    return f"{index}_{module.kind}_{short}.py"


def synthesize_suite(
    out: Path,
    *,
    count: int,
    seed: int = 0,
    held_out: float = 0.15,
    workers: int = 2,
    validation_timeout_s: float = 60.0,
    on_module: Callable[[int, int], object] | None = None,
    teachable: bool = True,
) -> SuiteSummary:
    """Writes the suite under ``out`` (skipping modules its manifest already lists): the
    teacher's (``train/``, ``heldout/``, ``modules.jsonl``) or, without ``teachable``, the
    Proposer's (``proposer/``, ``proposer_modules.jsonl``, nothing held out)."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / (MANIFEST if teachable else PROPOSER_MANIFEST)
    done: dict[str, dict[str, Any]] = {}
    # rows of modules.jsonl: index, digest, api_set, kind, split, valid, reason, file
    if manifest.exists():
        for line in manifest.read_text().splitlines():
            row = json.loads(line)
            done[row["digest"]] = row
    modules = list(Synthesizer(seed=seed, teachable=teachable).modules(count))
    todo = [(i, m) for i, m in enumerate(modules) if m.digest not in done]
    for m in modules:  # a folder copied without its suite (only modules.jsonl) gets it back
        row = done.get(m.digest)
        if row is not None and row["valid"]:
            path = out / str(row["file"])
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(m.source)

    def check(item: tuple[int, SynthModule]) -> dict[str, Any]:
        i, m = item
        result = validate_module(m.source, m.api_set, timeout_s=validation_timeout_s)
        split = ("heldout" if is_held_out(m, held_out) else "train") if teachable else "proposer"
        file = f"{split}/{_file_name(i, m)}"
        row = {"index": i, "digest": m.digest, "api_set": list(m.api_set), "kind": m.kind,
               "split": split, "valid": result.valid, "reason": result.reason,
               "file": file if result.valid else None}
        if result.valid:
            path = out / file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(m.source)
        return row

    with manifest.open("a") as f, ThreadPoolExecutor(max(1, workers)) as pool:
        already = len(modules) - len(todo)
        for n, row in enumerate(pool.map(check, todo), start=1):
            f.write(json.dumps(row) + "\n")
            f.flush()
            done[row["digest"]] = row
            if on_module is not None:
                on_module(already + n, len(modules))
    rows = [done[m.digest] for m in modules]
    reasons: dict[str, int] = {}
    for r in rows:
        if not r["valid"]:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    valid = [r for r in rows if r["valid"]]
    return SuiteSummary(
        modules=len(rows),
        valid=len(valid),
        train=sum(1 for r in valid if r["split"] in _TRAIN_SPLITS),
        held_out=sum(1 for r in valid if r["split"] == "heldout"),
        invalid_reasons=reasons,
    )


def sft_example(prompt: list[dict[str, str]], answer_code: str, **meta: Any) -> dict[str, Any]:
    """One row in TRL's conversational prompt-completion form."""
    return {"prompt": prompt,
            "completion": [{"role": "assistant", "content": fence_code(answer_code)}], **meta}


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    n = 0
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            n += 1
    return n


def write_proposer_sft(out: Path) -> int:
    """Writes ``proposer_sft.jsonl``: every valid training module of both suites (API set ->
    module, in the Proposer's prompt); returns the count."""
    train: dict[str, dict[str, Any]] = {}
    for name in (MANIFEST, PROPOSER_MANIFEST):
        if (out / name).exists():
            for line in (out / name).read_text().splitlines():
                r = json.loads(line)
                if r["valid"] and r["split"] in _TRAIN_SPLITS:
                    train.setdefault(r["digest"], r)
    proposer = []
    for r in train.values():
        source = (out / r["file"]).read_text()
        proposer.append(sft_example([{"role": m["role"], "content": m["content"]}
                                     for m in proposer_messages(r["api_set"])], source,
                                    api_set=r["api_set"], kind=r["kind"]))
    return _write_jsonl(out / PROPOSER_SFT, proposer)


@dataclass(frozen=True)
class SftSets:
    """What ``write_sft_sets`` wrote, and the teacher's verdicts it chose from."""

    coder: int
    proposer: int
    teacher_verdicts: dict[str, int]  # status -> kernels

    @property
    def unjudged(self) -> int:
        """Teacher kernels this host could not judge (``infra_error``): not in the Coder set."""
        return self.teacher_verdicts.get("infra_error", 0)

    def describe(self) -> str:
        """One line: the verdicts, and what to do about kernels the host could not judge."""
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(self.teacher_verdicts.items(),
                                                             key=lambda sn: (-sn[1], sn[0])))
        line = f"teacher kernels: {statuses or 'none verified'}"
        if self.unjudged:
            # Seen on a GPU host: Triton 3.6's interpreter under NumPy 2.4 and 2.5 fails
            # every kernel that loops over a run-time bound (all matmuls), and the Coder set
            # silently lost them.
            line += (f"; {self.unjudged} could not be judged on this host and are left out "
                     "of the Coder set (the verifier's log says why): run the command again "
                     "where they can be judged (on a GPU, or with a Triton interpreter that "
                     "passes the verifier's self-check)")
        return line


async def write_sft_sets(out: Path, store: Any) -> SftSets:
    """Writes ``coder_sft.jsonl`` (the correct teacher kernels in the store) and
    ``proposer_sft.jsonl``."""
    from kz_stream.export import KernelFilter, collect_rows

    run_id = teacher_run_id(out)
    rows, _ = await collect_rows(store, KernelFilter(runs=(run_id,)), sets=["sft", "verdicts"])
    coder = [
        sft_example(json.loads(r["prompt"]), r["kernel"], module_id=r["module_id"],
                    kernel_id=r["kernel_id"], policy=r["run_id"])
        for r in rows["sft"]
    ]
    latest = {r["kernel_id"]: r["status"] for r in rows["verdicts"]}  # a resume re-judges
    return SftSets(_write_jsonl(out / CODER_SFT, coder), write_proposer_sft(out),
                   dict(Counter(latest.values())))
