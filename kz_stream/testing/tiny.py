"""A tiny causal LM, its tokenizer, a checkable task and a sampler that records logprobs.

The model is built from a config (no download): a 2-layer Llama over a 15-token
vocabulary. The task: after ``<bos> d =`` answer the digit ``(d + 3) mod 10`` and stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kz_stream.rl.groups import Group, Sample

DIGITS = [str(d) for d in range(10)]
VOCAB = {**{d: i for i, d in enumerate(DIGITS)}, "<bos>": 10, "<eos>": 11, "<pad>": 12, "=": 13}
VOCAB["<unk>"] = 14
BOS, EOS, PAD, EQ = 10, 11, 12, 13


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def tiny_model(seed: int = 0, init_range: float = 0.3) -> LlamaForCausalLM:
    # A large init range gives the random model confident, uneven preferences, as a trained
    # model has; at the default 0.02 its logits are too flat for LoRA to sharpen, because
    # LoRA cannot touch the LM head.
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=16,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        initializer_range=init_range,
    )
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def prompt_text(d: int) -> str:
    return f"<bos> {d} ="


def prompt_ids(d: int) -> list[int]:
    return [BOS, d, EQ]


def target(d: int) -> int:
    return (d + 3) % 10


@torch.no_grad()
def sample_ids(
    model: Any,  # anything with generate(): a PreTrainedModel or a PeftModel
    prompt: list[int],
    n: int,
    max_new_tokens: int,
    eos: int,
    pad: int,
) -> list[tuple[list[int], list[float]]]:
    """Samples ``n`` completions at temperature 1; returns (token ids, behaviour logprobs).

    The logprobs are of the raw distribution (no top-k/top-p), which is the one sampled,
    so they are the behaviour logprobs the importance correction needs.
    """
    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt] * n, device=next(model.parameters()).device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        output_logits=True,
        return_dict_in_generate=True,
    )
    model.train(was_training)
    new = out.sequences[:, ids.shape[1] :]
    logps = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
    chosen = logps.gather(-1, new.unsqueeze(-1)).squeeze(-1)
    result = []
    for row, lp in zip(new.tolist(), chosen.tolist(), strict=True):
        end = row.index(eos) + 1 if eos in row else len(row)
        result.append((row[:end], lp[:end]))
    return result


def sample(
    model: torch.nn.Module, d: int, n: int, max_new_tokens: int = 2
) -> list[tuple[list[int], list[float]]]:
    return sample_ids(model, prompt_ids(d), n, max_new_tokens, EOS, PAD)


@dataclass
class Verdict:
    correct: bool
    speedup: float
    speedup_ci: tuple[float, float]


def verify(d: int, completion: list[int]) -> Verdict:
    """Correct iff the first token is the answer; "faster" (2x) iff it then stops."""
    correct = bool(completion) and completion[0] == target(d)
    speed = 2.0 if completion[1:] == [EOS] else 1.0
    return Verdict(correct, speed, (0.9 * speed, 1.1 * speed))


def make_groups(
    model: torch.nn.Module, digits: list[int], n: int, version: int, tag: str
) -> list[Group]:
    groups = []
    for d in digits:
        samples = []
        for j, (comp, lps) in enumerate(sample(model, d, n)):
            v = verify(d, comp)
            samples.append(
                Sample(
                    group_id=f"{tag}-g{d}",
                    prompt=prompt_text(d),
                    prompt_ids=tuple(prompt_ids(d)),
                    completion_ids=tuple(comp),
                    logprobs=tuple(lps),
                    policy_version=version,
                    kernel_id=f"{tag}-k{d}-{j}",
                    module_id=f"m{d}",
                    correct=v.correct,
                    speedup=v.speedup,
                    speedup_ci=v.speedup_ci,
                )
            )
        groups.append(Group(f"{tag}-g{d}", tuple(samples)))
    return groups
