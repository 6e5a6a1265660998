"""FLOP counting a family's ``flops.py`` shares: its table of linears -> the LoRA adapters' forward FLOPs."""
from __future__ import annotations

def lora_linears_flops(linears: dict[str, tuple[int, int, str]], family: str, examples: str, rank: int, targets,
                       batch: int, image_tokens: int, text_tokens: int) -> float:
    """FLOPs of the LoRA adapters in one forward over ``batch`` rows: every linear of ``linears`` (diffusers name
    -> (in, out, stream)) that ``targets`` selects (peft's rule: the name equals a target or ends with
    ``"." + target``); ValueError for a target that names no linear (its FLOPs would go uncounted)."""
    tokens = {"image": image_tokens, "text": text_tokens, "sample": 1}

    def selects(name: str, target: str) -> bool:
        return name == target or name.endswith("." + target)

    if unknown := [t for t in targets if not any(selects(n, t) for n in linears)]:
        raise ValueError(f"LoRA targets {unknown} name no {family} linear; expected diffusers module names such as "
                         f"{examples}")
    chosen = [dims for name, dims in linears.items() if any(selects(name, t) for t in targets)]
    return float(batch) * sum(2 * rank * (k + n) * tokens[stream] for k, n, stream in chosen)
