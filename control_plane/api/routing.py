"""The route class of every router: a blocking (sync) endpoint runs on its lane's threads
(`control_plane.lanes`), and its response is checked on the event loop.

FastAPI runs a sync endpoint in its shared thread pool and then, after the endpoint returned but
before the request's dependencies exit, checks the response in that pool again. The request's
transaction (`SessionDep`) is still open at that point: a second wait for a thread while holding
the write lock or a pooled connection, which the requests holding the pool's threads were
waiting for. `LaneRoute` turns such an endpoint into a coroutine that runs it on a lane's thread,
so FastAPI checks the response on the event loop: from its first statement to its commit (in the
dependencies' exits, which FastAPI runs without a thread limit), a transaction waits for no
thread. Async endpoints are left as they are.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi.routing import APIRoute

from control_plane.api.deps import ContextDep
from control_plane.context import AppContext
from control_plane.lanes import lane_of

#: The parameter the wrapper adds to find the app's lanes (FastAPI resolves it once per request
#: with the endpoint's own `ContextDep`, if any).
_CONTEXT = "_modelforge_lane_context"


class LaneRoute(APIRoute):
    """An `APIRoute` whose sync endpoint runs on the lane its path belongs to."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = on_lane(endpoint, lane_of(path))
        super().__init__(path, endpoint, **kwargs)


def on_lane(endpoint: Callable[..., Any], lane: str) -> Callable[..., Any]:
    """`endpoint` as a coroutine function with the same parameters (and one more, the app
    context), running it on the app's `lane`."""
    signature = inspect.signature(endpoint)
    context = inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=ContextDep)

    @functools.wraps(endpoint)
    async def run_on_lane(**arguments: Any) -> Any:
        ctx: AppContext = arguments.pop(_CONTEXT)
        return await ctx.lanes[lane].run(functools.partial(endpoint, **arguments))

    run_on_lane.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), context]
    )
    return run_on_lane
