"""One public/private rule: a package's modules are private (a leading underscore), its API
is its ``__all__``, pinned here, and no code outside a package imports its private modules."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = {
    "kz_stream.bus": [
        "DEFAULT_DEAD_LETTER_TOPIC", "HEADER_ERROR", "HEADER_ERROR_TYPE", "HEADER_EVENT_ID",
        "HEADER_GROUP", "HEADER_ORIGINAL_OFFSET", "HEADER_ORIGINAL_PARTITION",
        "HEADER_ORIGINAL_TOPIC", "HEADER_SCHEMA_VERSION", "HEADER_TYPE", "Bus", "BusMessage",
        "Handler", "InMemoryBus", "InfrastructureError", "KafkaBus", "OffsetStore",
        "SubscribeOptions", "Subscription", "SubscriptionStats", "TopicSpec",
        "dead_letter_headers", "event_headers", "offsets_after", "open_bus",
    ],
    "kz_stream.llm": [
        "LOGPROB_DEFINITION", "BackendError", "BackendKind", "BackendLost", "BackendUnavailable",
        "ChatMessage",
        "KVCache",
        "LLMBackend", "ProcessBackend",
        "Prompt", "Sample", "SamplingParams", "ServingBackend", "TransformersBackend",
        "VLLMEngineBackend", "VLLMServer", "VLLMServerBackend", "create_backend",
        "encode_prompt", "smollm2_dir", "uri_to_path",
    ],
    "kz_stream.modules": [
        "ARITHMETIC_OPS", "CATALOG_FORMAT", "CODER_EXAMPLES", "CODER_EXAMPLE_MODULE",
        "DEFAULT_SOURCES", "LAYOUT_OPS", "PROPOSER_EXAMPLES", "ApiCatalog", "ApiSetSampler",
        "ApiUse", "Frontier", "InputSpec", "ModuleFingerprint", "canonical_api",
        "coder_messages", "default_catalog", "extract_code", "fence_code", "find_api_calls",
        "fingerprint_modules", "is_neutral", "mine_catalog", "mine_files",
        "normalized_hash", "package_files", "parse_pair_key", "prompt_text",
        "proposer_messages", "static_apis", "tensor_methods", "validate_module",
        "validate_with_fingerprint",
    ],
    "kz_stream.evaluation": [
        "FAST_P", "PASS_K", "STATUS_COLOURS", "EvalOptions", "EvalProgress", "EvalRecord",
        "EvalReport", "ProblemResult", "Suite", "SuiteMetrics", "SuiteProblem", "build_report",
        "fast_p", "geomean_speedup", "kernel_id_of", "level_name", "load_evaluation",
        "load_suite", "markdown", "new_run_id", "open_policy", "pass_at_k",
        "problem_interface_error", "run_evaluation", "summarize", "summarize_levels",
        "table_rows", "write_plots", "write_report", "StageTimes", "Throughput", "throughput",
        "throughput_line", "union_seconds", "Baseline", "COMPILE_FAST_P",
        "clustered_difference_in_se", "difference_in_se", "MergedReport", "merge_reports",
        "write_merged",
    ],
    "kz_stream.store": [
        "AppendResult", "ConcurrencyError", "EventStore", "RecordedEvent", "SqlEventStore",
        "SqlTransaction", "StoreNotFound", "StoreTransaction", "metadata", "open_store", "upgrade",
    ],
}
# Benchmarks may import the internals they measure (the store's COPY path, say).
MEASURES_INTERNALS = "benchmarks"


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_the_public_api_is_pinned_and_every_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PUBLIC[package])
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    modules = [p.stem for p in (ROOT / package.replace(".", "/")).glob("*.py")]
    assert all(m.startswith("_") for m in modules), f"public modules in {package}: {modules}"


def _private_imports(path: Path, package: str) -> list[str]:
    """Imports in ``path`` of a private module of ``package`` or a private name of it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.module.startswith(package + ".") else []
            if node.module == package:
                names = [f"{package}.{a.name}" for a in node.names if a.name.startswith("_")]
            found += names
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(package + "._")]
    return found


def test_no_code_outside_a_package_imports_its_private_modules() -> None:
    offenders = []
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        if rel.parts[0] == MEASURES_INTERNALS:
            continue
        for package in PUBLIC:
            if rel.parent.as_posix().startswith(package.replace(".", "/")):
                continue
            offenders += [f"{rel}: {m}" for m in _private_imports(path, package)]
    assert offenders == []


def test_the_packages_import_light() -> None:
    """Importing the APIs loads neither torch nor the services (a run imports them)."""
    code = (
        "import sys, kz_stream.llm, kz_stream.modules, kz_stream.evaluation, kz_stream.bus\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'producers', 'consumers')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
