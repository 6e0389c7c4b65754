"""Which inputs a call wrote in place, for normal tensors and for inference tensors alike.

Why. A captured CUDA graph reads its own copies of the inputs. When the region writes an input in
place (a KV cache filled at a position), the replay writes the copy, so surgery must copy it
back to the caller's tensor after every replay, and must not read such an input in place from
another region's buffers. So at capture time it has to know which inputs the region writes.

How. A normal tensor carries a version counter that every in-place op bumps, so the answer is
exact. An inference tensor (made under ``torch.inference_mode()``) has none: ``t._version``
raises "Inference tensors do not track version counter". For those the probe keeps a copy of the
bytes before the call and compares after it. That sees every write that changes a byte; a write
that leaves every byte as it was (the same value written again) is not seen. surgery asks at two
calls, the second uncaptured call and the capture's own run, and takes the union.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as raw bytes, so NaN compares equal to the same NaN."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class WriteProbe:
    """Taken before a call on its input tensors; ``written()`` after it says which it wrote."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        # An inference tensor's bytes, or a normal tensor's version counter.
        self._before: list[torch.Tensor | int] = [
            _bytes(t).clone() if t.is_inference() else t._version for t in tensors]

    def written(self, tensors: Sequence[torch.Tensor]) -> set[int]:
        """Indices of the tensors written in place since the probe was taken."""
        out = set()
        for i, (t, before) in enumerate(zip(tensors, self._before, strict=True)):
            if isinstance(before, int):
                if t._version != before:
                    out.add(i)
            elif not torch.equal(_bytes(t), before):
                out.add(i)
        return out
