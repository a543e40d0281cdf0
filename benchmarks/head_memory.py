#!/usr/bin/env python
"""Peak memory of the LM head (final norm + LM head + cross-entropy), chunked vs unchunked.

For each sequence length s, runs forward + backward of the head alone with
``x: [s, 1, h]`` and a ``[V, h]`` weight (V = 50257, GPT-2's vocabulary; small h so the
head's logits dominate, as they do per token at long s) and prints the peak of the bytes
of tensor storage that were live at once, above what existed before the pass:

- chunked: memo's head (``memo.models.LMHead`` -> ``chunked_lm_loss``).
- unchunked: the same norm and weight, full ``[s, V]`` logits, ``F.cross_entropy``.

How it is measured: a ``TorchDispatchMode`` sees every aten op's output, counts each new
storage's bytes when it appears and uncounts them when the storage is freed (a weakref
callback), and keeps the maximum. That is the allocation stream torch really produced;
kernel-internal scratch below the dispatcher is not included (the same for both).

Rows whose unchunked run would not fit in ``--max-real-gib`` of host memory are run with
the same tracker on the meta device, which issues the same aten ops with the same output
shapes but allocates nothing; they are marked ``meta``. The sizes run both ways are
compared and must agree, which is printed as a check.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memo.models import LMHead

VOCAB = 50257


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created while the mode is active and live at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        # storage python id -> (bytes, weakref); the weakref must stay referenced to fire.
        self._owned: dict[int, tuple[int, weakref.ref]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._track(leaf.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        size = storage.nbytes()
        if key in self._owned or size == 0:
            return
        self._owned[key] = (size, weakref.ref(storage, self._on_free(key)))
        self.live += size
        self.peak = max(self.peak, self.live)

    def _on_free(self, key: int):
        def free(_ref: weakref.ref) -> None:
            size, _ = self._owned.pop(key)
            self.live -= size

        return free


def _head(hidden: int, device: str) -> tuple[nn.LayerNorm, nn.Parameter]:
    norm = nn.LayerNorm(hidden, device=device)
    weight = nn.Parameter(torch.randn(VOCAB, hidden, device=device) * 0.02)
    return norm, weight


def measure(s: int, hidden: int, chunked: bool, device: str) -> tuple[int, float]:
    """(peak live bytes of one head forward + backward, seconds)."""
    norm, weight = _head(hidden, device)
    x = torch.randn(s, 1, hidden, device=device, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, s), device=device)
    head = LMHead(norm, weight)
    gc.collect()
    start = time.perf_counter()
    with LiveBytes() as tracker:
        if chunked:
            loss = head(x, labels)
        else:
            logits = norm(x).reshape(s, hidden) @ weight.t()
            loss = F.cross_entropy(logits, labels.t().reshape(s))
            del logits
        loss.backward()
        del loss
    return tracker.peak, time.perf_counter() - start


def _gib(n: int) -> str:
    return f"{n / 2**30:8.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64, help="hidden size h (default 64, tiny's)")
    parser.add_argument(
        "--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536], help="sequence lengths"
    )
    parser.add_argument(
        "--max-real-gib", type=float, default=4.0,
        help="run a size on real CPU memory only if the unchunked logits and their gradient "
        "(2·s·V·4 bytes) fit in this many GiB; larger sizes are measured on the meta device",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    print(f"LM head forward+backward peak memory, h={args.hidden}, V={VOCAB}, b=1, float32")
    columns = ("s", "where", "chunked GiB", "unchunked GiB", "ratio", "time c/u (s)")
    widths = (7, 5, 12, 14, 8, 14)
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    checks = []
    for s in args.seq:
        real = 2 * s * VOCAB * 4 <= args.max_real_gib * 2**30
        device = "cpu" if real else "meta"
        peak_c, t_c = measure(s, args.hidden, True, device)
        peak_u, t_u = measure(s, args.hidden, False, device)
        if real:
            # Same allocation stream on meta: shows the meta rows measure what CPU would do.
            checks.append((s, peak_c == measure(s, args.hidden, True, "meta")[0],
                           peak_u == measure(s, args.hidden, False, "meta")[0]))  # fmt: skip
        times = f"{t_c:6.2f}/{t_u:<6.2f}" if real else "-"
        ratio = f"{peak_u / peak_c:>7.1f}x"
        print(f"{s:>7} {device:>5} {_gib(peak_c):>12} {_gib(peak_u):>14} {ratio} {times:>14}")
    for s, same_c, same_u in checks:
        verdict = "identical" if same_c and same_u else "DIFFERENT"
        print(f"check s={s}: cpu and meta peaks are {verdict}")
    if not all(c and u for _, c, u in checks):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
