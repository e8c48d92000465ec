"""The placement comparison of trained weights, shared by the placement-invariance tests.

Placements train the same data but may sum the same transitions' gradients in another order:
the step plan shares fragments by measured speed, LPT dispatches by measured cost, TSP packs a
fragment over a different number of trainers. Float32 reassociation then moves a weight by a few
ulps of the largest terms summed into it, not of the weight itself, so an element-wise relative
tolerance fails by chance on a weight near zero (a LoRA A entry of 1e-3 differing by 1.1e-7). The
comparison is per tensor against its own scale: max|a - b| <= 3e-4 * max|b|. AdamW amplifies
the rounding where a weight's gradient is itself a small difference of its transitions' gradients
(its update is m / sqrt(v), whatever the gradient's size), and TAG's packing follows measured
timings, so the figure varies from run to run. Seen: 2.6e-8 on a LoRA B of scale 7.4e-4 (3.4e-5 of
it); 1.0e-4 between forwards of 2 and of 4 transitions under TSP (tests/test_tsp.py); 2.2e-4 once
in the heterogeneous gap+tag run (4.33e-7 on a LoRA B of scale 2.0e-3, tests/test_heterogeneous.py).
A placement that trains other data moves the update by its own size, 3 orders of magnitude above.
The rounding also reaches the next step's images (generated with the updated weights), and a reward
that jumps, as JPEG compressibility does (it counts bytes), can turn their last bits into another
reward and, in a group of 2, another advantage: tensors up to 7% of their scale apart after 4
steps of 1 + 2 FSDP2 trainers against colocated FSDP2 over 3 ranks. Such comparisons use a
continuous reward."""

REL = 3e-4
"""The placement comparison's tolerance, per tensor against its own scale (the reasons above)."""


def assert_same_weights(a: dict, b: dict, what: str, rel: float = REL) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        x, y = a[name].double(), b[name].double()
        assert x.shape == y.shape, f"{what}: {name} {tuple(x.shape)} != {tuple(y.shape)}"
        scale = y.abs().max().item()
        diff = (x - y).abs().max().item()
        assert diff <= rel * scale + 1e-12, f"{what}: {name} differs by {diff:.3g} (scale {scale:.3g}, rel {rel:g})"
