"""Whether a route's copy of a weight (the fast route's layout, an int8 form) still holds the weight's
values, told without reading them.

A copy is made from a parameter once and kept; it is made again when the parameter's stamp has changed:
the tensor it lives in (its memory, shape, strides, dtype, device), the version counter that every
in-place write through the parameter advances (an optimizer step, load_state_dict, `p.mul_` under
no_grad), and the count of optimizer steps taken in this process, since a fused optimizer step
(torch.optim.Adam(..., fused=True)) writes the parameters without advancing their counters. A
parameter made under torch.inference_mode() has no version counter; it can be written in place only
under inference mode again, which nothing that trains does. What no stamp sees is a write through
`.data` in place (`p.data.mul_(2)`: `.data` has a counter of its own): after one, make the route again
(or call its `refresh`).

What the count costs a process that trains: the first stamp taken (the first route copy made) registers
one hook for every optimizer of the process (torch.optim's global post-step hook; importing refdec
registers nothing), a Python call that adds 1 to a counter at each step, well under a microsecond beside
a step of milliseconds. Steps taken before it need no counting: no copy existed to go out of date.
Since the count is one for the whole process, any optimizer step, of any model, marks every route's
copies out of date: a route used for decoding between training steps (a trainer's evaluation) makes
its layout and int8 forms again at its next call after each step, one copy of the weights it lays out.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_optimizer_steps = [0]  # optimizer steps taken in this process, by any optimizer, since the first stamp
_counting: list = []  # the hook's handle, once the first stamp has registered it


def _count_step(optimizer, args, kwargs) -> None:
    _optimizer_steps[0] += 1


def stamp(t: torch.Tensor) -> tuple:
    """What identifies a tensor's values without reading them (the module docstring)."""
    if not _counting:  # the first copy of a weight is being made: from now on optimizer steps count
        _counting.append(register_optimizer_step_post_hook(_count_step))
    version = None if t.is_inference() else t._version
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, version, _optimizer_steps[0]
