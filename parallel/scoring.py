"""Where rewards are computed: on the generator itself, or on scorer ranks (docs/DESIGN.md, roles).

Both scorers have one interface: `submit` a decoded fragment, later `wait` for its scores. The
remote one sends the images to scorer rank `fragment % R` and returns at once, so the generator
can denoise its next fragment while the scorer works; scores come back in submission order.
The scorer rank computes the weighted combination too, so every placement combines bitwise alike.
Rewards served over HTTP (rewards/remote.py) are sent at `submit` and collected at `wait`, so a
local scorer with one lags like a remote one: the generator denoises its next fragment while the
service scores. A scorer rank sends a fragment to the services before it computes its local
rewards, and answers the generator before it takes its next fragment.
Images travel on each scorer's communicator, scores on each generator's (parallel/topology.py):
the generator sends a fragment's images before it waits for the previous fragment's scores, and
the scorer sends those scores before it receives the next images, which on one communicator would
wait for each other on NCCL (docs/communication.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from parallel import p2p


@dataclass
class Ticket:
    step: int
    fragment: int
    scores: dict[str, Tensor] | None = None  # filled at once by a local scorer
    dst: int | None = None
    handle: object = None


class LocalScorer:
    """Scores on this rank: at once, or (rewards served over HTTP) when the services answer."""

    def __init__(self, rewards):
        self.rewards = rewards  # a rewards.RewardSet; None on a rank that never scores (a GAP stage before the last)
        self.remote = rewards is not None and rewards.remote  # services score while this rank denoises on

    def submit(self, step: int, fragment: int, images: Tensor, prompts: list[str], metadata: list[dict]) -> Ticket:
        return Ticket(step, fragment, handle=self.rewards.submit(images, prompts, metadata))

    def wait(self, ticket: Ticket) -> dict[str, Tensor]:
        if ticket.scores is None:
            ticket.scores = ticket.handle.result()  # waits for the reward services, if any
        return ticket.scores


class RemoteScorer:
    """The generator's side of scorer ranks."""

    remote = True

    def __init__(self, scorer_ranks: tuple[int, ...], images_groups: dict | None = None, scores_group=None):
        """`images_groups`: scorer rank -> the communicator images to it go on; `scores_group`: the
        one this rank's scores come back on (ProcessGroups.images and .scores; None: the default)."""
        self.scorer_ranks = scorer_ranks
        self.images_groups, self.scores_group = images_groups or {}, scores_group

    def scorer_of(self, fragment: int) -> int:
        return self.scorer_ranks[fragment % len(self.scorer_ranks)]

    def submit(self, step: int, fragment: int, images: Tensor, prompts: list[str], metadata: list[dict]) -> Ticket:
        dst = self.scorer_of(fragment)
        handle = p2p.isend_framed({"images": images.float().contiguous()}, {"step": step, "fragment": fragment},
                                  dst=dst, group=self.images_groups.get(dst))
        return Ticket(step, fragment, dst=dst, handle=handle)

    def wait(self, ticket: Ticket) -> dict[str, Tensor]:
        scores = p2p.post_recv(ticket.dst, self.scores_group, device=torch.device("cpu"))
        tensors, meta = scores.wait()  # rank wait: the scorer
        if (meta["step"], meta["fragment"]) != (ticket.step, ticket.fragment):
            raise p2p.ProtocolError(f"scores of step {meta['step']} fragment {meta['fragment']} arrived for {ticket}")
        ticket.handle.wait()
        return {k: v.clone() for k, v in tensors.items()}


def scorer_step(ctx, rewards, plan, source_of, images_group=None, scores_groups: dict | None = None
                ) -> dict[str, list[float]]:
    """One step of a scorer rank: score the fragments assigned to it (fragment % R == its index),
    in plan order, each received from the rank `source_of(fragment)` that generated it (None: a
    TAG trainer generated it and scored it itself), on `images_group`; the scores go back to
    each generator on its communicator of `scores_groups`."""
    scores_groups = scores_groups or {}
    me = ctx.topo.scorer_ranks.index(ctx.rank)
    num = len(ctx.topo.scorer_ranks)
    sends, busy = [], {}
    for fragment in plan.fragments:
        if fragment.index % num != me:
            continue
        src = source_of(fragment)
        if src is None:
            continue
        with ctx.tracer.span("recv_images", "comm", plan.step, fragment.index):
            images = p2p.post_recv(src, images_group, device=ctx.device)
            tensors, meta = images.wait()  # rank wait: the generator
        if (meta["step"], meta["fragment"]) != (plan.step, fragment.index):
            raise p2p.ProtocolError(f"images of step {meta['step']} fragment {meta['fragment']} arrived, expected "
                                    f"fragment {fragment.index} of step {plan.step}")
        g = plan.group_size
        records = [ctx.records[plan.prompt_indices[i // g]] for i in fragment.sample_ids]
        with ctx.tracer.span("score", "score", plan.step, fragment.index), ctx.slowdown():
            scores = rewards.score_combined(tensors["images"], [r.prompt for r in records], [r.metadata for r in records])
        sends.append(p2p.isend_framed(scores, meta, dst=src, group=scores_groups.get(src)))
        busy[fragment.index] = len(records)
    for h in sends:
        h.wait()
    return busy
