"""An agent's work claim, from its arrival to the job it is handed (SC-1, WL-6a): the rules both
the claim route and the agents' fast path follow, so neither holds any of its own.

A claim waits in the scheduler until a job is placed for it, its hold ends, or its connection
closes. A claim whose client has gone is withdrawn, and a job placed for it goes back to the
queue: no job is handed to a claim nobody reads. A job whose secrets the node may not receive
(checked again here, against the node's signed credential) is failed rather than handed over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from control_plane.errors import ModelForgeError
from control_plane.fleet.credentials import CredentialAuthority, NodePrincipal
from control_plane.jobs.reports import Outcome
from control_plane.scheduling.completions import Completions
from control_plane.scheduling.placement import PlacedJob
from control_plane.scheduling.scheduler import Scheduler
from control_plane.scheduling.shapes import labels_match

#: What `claim_until_closed` returns when the agent closed the connection first.
CLOSED = object()


async def claim_until_closed(
    *,
    scheduler: Scheduler,
    authority: CredentialAuthority,
    completions: Completions,
    node: NodePrincipal,
    hold: float,
    closed: Callable[[], Awaitable[object]],
) -> PlacedJob | None | object:
    """Wait for a job for `node`: the job, None at the end of the hold, or `CLOSED` when the
    connection closed first (a stopped agent, a balancer's timeout) — the claim is withdrawn
    then, and a job placed for it meanwhile goes back to the queue, so no job is handed to a
    claim nobody reads. A claim whose credential is revoked meanwhile gets None."""
    waiting = asyncio.ensure_future(
        scheduler.claim(node.node_id, hold, lambda: authority.still_active(node))
    )
    # The body is read: what `closed` waits for next is the disconnect (ASGI `receive`, or
    # RSGI's `client_disconnect`).
    closing = asyncio.ensure_future(closed())
    await asyncio.wait((waiting, closing), return_when=asyncio.FIRST_COMPLETED)
    if waiting.done():
        closing.cancel()
        placed = waiting.result()
        if isinstance(placed, PlacedJob) and not may_receive_secrets(placed, node):
            with contextlib.suppress(ModelForgeError):  # cancelled meanwhile: it ends anyway
                await completions.record(_secret_not_permitted(placed, node))
            return None
        return placed
    waiting.cancel()
    (outcome,) = await asyncio.gather(waiting, return_exceptions=True)
    if isinstance(outcome, PlacedJob):  # answered just as it was withdrawn
        scheduler.give_back(outcome)
    return CLOSED


def may_receive_secrets(placed: PlacedJob, node: NodePrincipal) -> bool:
    """WL-6a, checked again at delivery: the secrets' values were read for this node at
    placement, and its signed credential carries every label they require."""
    if not placed.secret_names:
        return True
    return placed.secrets is not None and labels_match(placed.secret_labels, node.labels)


def _secret_not_permitted(placed: PlacedJob, node: NodePrincipal) -> Outcome:
    return Outcome(
        job_id=placed.id,
        node_id=node.node_id,
        state="failed",
        result=None,
        outputs={},
        error=(
            "SECRET_NOT_PERMITTED",
            "the node's signed credential does not carry the labels of the job's "
            f"secrets ({', '.join(placed.secret_names)}), or a secret was deleted "
            "or its labels changed after the job was queued; submit it again",
        ),
    )
