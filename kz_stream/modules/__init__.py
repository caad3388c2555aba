"""Torch modules as the Proposer writes them: which APIs source code calls, the API
co-occurrence catalog and the sampler of API sets, the prompts of both roles, code
extraction from completions, the validation of a proposed module and its fingerprint
(APIs and input shapes, for decontamination). The modules of this
package are private; this is its API."""

from __future__ import annotations

from kz_stream.modules._apis import (
    ARITHMETIC_OPS,
    LAYOUT_OPS,
    ApiUse,
    canonical_api,
    find_api_calls,
    is_neutral,
    tensor_methods,
)
from kz_stream.modules._catalog import (
    CATALOG_FORMAT,
    DEFAULT_SOURCES,
    ApiCatalog,
    default_catalog,
    mine_catalog,
    mine_files,
    package_files,
)
from kz_stream.modules._extraction import extract_code, fence_code, normalized_hash
from kz_stream.modules._fingerprint import InputSpec, ModuleFingerprint
from kz_stream.modules._prompts import (
    CODER_EXAMPLE_MODULE,
    CODER_EXAMPLES,
    PROPOSER_EXAMPLES,
    coder_messages,
    prompt_text,
    proposer_messages,
)
from kz_stream.modules._sampling import ApiSetSampler, Frontier, parse_pair_key
from kz_stream.modules._validation import (
    fingerprint_modules,
    static_apis,
    validate_module,
    validate_with_fingerprint,
)

__all__ = [
    "ARITHMETIC_OPS",
    "CATALOG_FORMAT",
    "CODER_EXAMPLES",
    "CODER_EXAMPLE_MODULE",
    "DEFAULT_SOURCES",
    "LAYOUT_OPS",
    "PROPOSER_EXAMPLES",
    "ApiCatalog",
    "ApiSetSampler",
    "ApiUse",
    "Frontier",
    "InputSpec",
    "ModuleFingerprint",
    "canonical_api",
    "coder_messages",
    "default_catalog",
    "extract_code",
    "fence_code",
    "find_api_calls",
    "fingerprint_modules",
    "is_neutral",
    "mine_catalog",
    "mine_files",
    "normalized_hash",
    "package_files",
    "parse_pair_key",
    "prompt_text",
    "proposer_messages",
    "static_apis",
    "tensor_methods",
    "validate_module",
    "validate_with_fingerprint",
]
