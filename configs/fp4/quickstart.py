"""The quickstart model (~3.4M parameters, stdlib corpus) trained with FP4 GEMMs in every linear.

    pallasite train --config configs/fp4/quickstart.py --workdir /tmp/fp4     # W4A4 + DGE + OCC
    pallasite train --config configs/fp4/quickstart.py:variant=direct --workdir /tmp/fp4_d
    pallasite train --config configs/fp4/quickstart.py:cpu --workdir /tmp/fp4_s  # smoke

``variant``: ``fp4`` (DGE + OCC, α = 0.99), ``direct`` (W4A4, straight-through, no OCC),
``w4a8`` (DGE only), ``w8a4`` (OCC only), ``bf16`` (the float baseline, same compute dtype).
Sub-config fields can be overridden, e.g. ``--config.model.linear_config.alpha=0.97``. The rest
of the experiment is ``configs/quickstart.py`` (``cpu``/``runlocal`` shrink it the same way).
"""

from pallasite.configs import models, quickstart
from pallasite.training.config import parse_arg

VARIANTS = {
    "fp4": dict(linear="fp4", linear_config=dict()),
    "direct": dict(linear="fp4", linear_config=dict(w_grad="ste", occ=False)),
    "w4a8": dict(linear="fp4", linear_config=dict(a_bits=8, occ=False)),
    "w8a4": dict(linear="fp4", linear_config=dict(w_bits=8, w_grad="ste")),
    "bf16": dict(linear="float"),
}


def get_config(arg=None):
    a = parse_arg(arg, cpu=False, runlocal=False, variant="fp4")
    if a.variant not in VARIANTS:
        raise ValueError(
            f"configs/fp4/quickstart.py: variant={a.variant!r}; expected one of {sorted(VARIANTS)}"
        )
    c = quickstart.get_config("cpu" if a.cpu or a.runlocal else None)
    c.model = models.get("quickstart", dtype="bfloat16", **VARIANTS[a.variant])
    return c
