"""`modelforge-control-plane`: validate settings, prepare the data dir, migrate, serve with Granian;
with `--local-node` (or `MODELFORGE_LOCAL_NODE=true`; the flag wins) also a node agent and a
runtime worker beside it (control_plane/local_node.py), stopped with it. With `--artifacts-only`
it serves the agents' artifact routes alone, on the control plane's database and artifact store
(control_plane/artifact_host.py): no migration, no local node, no front.

Configuration errors end here with a readable message and exit code 2, before any server starts.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
import threading

from pydantic import ValidationError

from control_plane.access.admin_token import AdminTokenConfigError, resolve_admin_token
from control_plane.db import prepare_data_dir
from control_plane.local_node import LocalNode, LocalNodeError
from control_plane.local_node import check as check_local_node
from control_plane.native_front import FrontUnavailable, NativeFront, why_not
from control_plane.provisioning.config import ProvisionersError, load_provisioners
from control_plane.settings import Settings
from modelforge_contracts.settings_errors import describe_validation_error

EXIT_CONFIG = 2
EXIT_DATABASE = 1
#: How long Granian's worker has to stop after SIGTERM or Ctrl-C (it takes a few seconds,
#: waiting for the requests in flight) before it is killed.
WORKER_KILL_SECONDS = 30

log = logging.getLogger("modelforge.control_plane")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="modelforge-control-plane",
        description="ModelForge control plane (configured by MODELFORGE_* variables).",
    )
    parser.add_argument(
        "--local-node",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a node agent and a runtime worker beside the control plane, enrolled as a "
        "node labelled local=true (MODELFORGE_LOCAL_NODE; the flag wins)",
    )
    parser.add_argument(
        "--artifacts-only",
        action="store_true",
        help="serve only the agents' artifact routes, on the control plane's database and "
        "artifact store, for agents given MODELFORGE_AGENT_ARTIFACT_URL (docs/artifacts.md)",
    )
    return parser.parse_args(argv)


def wants_local_node(args: argparse.Namespace, settings: Settings) -> bool:
    """`--local-node` or `--no-local-node` when given, else MODELFORGE_LOCAL_NODE."""
    return bool(args.local_node) if args.local_node is not None else settings.local_node


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = Settings()
    except ValidationError as exc:
        _die(EXIT_CONFIG, "invalid configuration:\n" + describe_validation_error(exc, Settings))
    logging.getLogger().setLevel(settings.log_level.upper())
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    if args.artifacts_only:
        _serve_artifacts(args, settings)
        return
    local_node = None
    if wants_local_node(args, settings):
        try:
            check_local_node(settings)  # before anything is written
        except LocalNodeError as exc:
            _die(EXIT_CONFIG, str(exc))
        local_node = LocalNode(settings)
    _check_port_free(settings)  # before anything is written or started
    try:
        prepare_data_dir(settings.data_dir)
        source = resolve_admin_token(settings)
    except AdminTokenConfigError as exc:
        _die(EXIT_CONFIG, str(exc))
    except OSError as exc:
        _die(
            EXIT_CONFIG,
            f"MODELFORGE_DATA_DIR {settings.data_dir}: {exc.strerror}; it must be a directory "
            "this user owns and can make private (mode 0700)",
        )
    try:
        provisioners = load_provisioners(settings.provisioners_path)
    except ProvisionersError as exc:
        _die(EXIT_CONFIG, f"invalid provisioners file, not starting: {exc}")
    _migrate_or_die(settings)

    scheme = "https" if settings.tls_cert else "http"
    url = f"{scheme}://{settings.host}:{settings.port}"
    if source.generated:
        log.info("generated an admin token; it is in %s (mode 0600)", source.file)
    else:
        log.info("admin token from %s", source.origin)
    log.info("ModelForge control plane on %s (console at %s/, API docs at %s/docs)", url, url, url)
    if provisioners:
        names = ", ".join(f"{p.name} ({len(p.profiles)} profiles)" for p in provisioners)
        log.info("provisioners from %s: %s", settings.provisioners_path, names)
    log.info(
        "data dir %s, database %s",
        settings.data_dir.resolve(),
        "PostgreSQL" if settings.is_postgresql else "SQLite (embedded)",
    )
    if local_node is not None:
        log.info(
            "local node: a node agent and a runtime worker start beside it, their state and output "
            "in %s (turn off: MODELFORGE_LOCAL_NODE=false or --no-local-node)",
            local_node.paths.root,
        )
    _serve(settings, local_node)


def _check_port_free(settings: Settings) -> None:
    """Bind the address as Granian will (SO_REUSEADDR) and let it go: a port another program
    holds ends the start here with one line, not in Granian's backtrace after the local node's
    children have started."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            settings.host or None, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            _die(
                EXIT_CONFIG,
                f"MODELFORGE_PORT {settings.port} is in use on {settings.host}: stop what holds "
                "it or choose another port",
            )
        _die(
            EXIT_CONFIG,
            f"cannot listen on {settings.host}:{settings.port} ({exc.strerror or exc}); check "
            "MODELFORGE_HOST and MODELFORGE_PORT",
        )


def _serve_artifacts(args: argparse.Namespace, settings: Settings) -> None:
    from sqlalchemy.exc import SQLAlchemyError

    from control_plane import artifact_host

    if args.local_node:
        _die(EXIT_CONFIG, "--artifacts-only runs no local node; leave out --local-node")
    _check_port_free(settings)
    try:
        prepare_data_dir(settings.data_dir)
        artifact_host.check_database(settings)
    except OSError as exc:
        _die(EXIT_CONFIG, f"MODELFORGE_DATA_DIR {settings.data_dir}: {exc.strerror}")
    except artifact_host.SchemaNotCurrent as exc:
        _die(EXIT_DATABASE, str(exc))
    except SQLAlchemyError as exc:
        _die_unreachable(exc)
    scheme = "https" if settings.tls_cert else "http"
    log.info(
        "ModelForge artifact host on %s://%s:%s (the agents' artifact routes only), artifacts in "
        "%s",
        scheme,
        settings.host,
        settings.port,
        (settings.data_dir / "artifacts").resolve(),
    )
    artifact_host.serve(settings, worker_kill_seconds=WORKER_KILL_SECONDS)


def _migrate_or_die(settings: Settings) -> None:
    from sqlalchemy.exc import SQLAlchemyError

    from control_plane.db import make_engine, migrate

    engine = make_engine(settings.sqlalchemy_url)
    try:
        migrate(engine, lock_dir=settings.data_dir)
    except SQLAlchemyError as exc:
        _die_unreachable(exc)
    finally:
        engine.dispose()


def _die_unreachable(exc: Exception) -> None:
    """End the start on a database that does not answer; any other database error is raised."""
    from control_plane.db import is_database_unavailable

    if not is_database_unavailable(exc):
        raise exc
    _die(
        EXIT_DATABASE,
        f"cannot reach the database ({type(exc).__name__}); check "
        "MODELFORGE_DATABASE_URL and that the server is running",
    )


def _serve(settings: Settings, local_node: LocalNode | None) -> None:
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops

    front = _native_front(settings)
    server = Granian(
        target="control_plane.app:create_served_app",
        factory=True,
        # RSGI: the agents' requests skip the ASGI bridge (api/rsgi.py, HB-4 throughput).
        interface=Interfaces.RSGI,
        # Agents and the console speak HTTP/1.1; uvloop for the event loop (HB-4 throughput).
        http=HTTPModes.http1,
        # The agents' tunnels (api/tunnel.py) are WebSockets.
        websockets=True,
        loop=Loops.uvloop,
        # Behind the native front, on a loopback port only it reaches (native_front.py).
        address=settings.host if front is None else "127.0.0.1",
        port=settings.port if front is None else front.upstream_port,
        workers=1,
        backpressure=settings.max_concurrent_requests,
        # Granian's worker can hang for ever in its own shutdown under CPU pressure (its runtime
        # dropped while the GIL is held, as in Granian's issue 875); seen with an agent's long
        # polls in flight. A worker not stopped by then is killed, so a stop always ends.
        workers_kill_timeout=WORKER_KILL_SECONDS,
        # TLS is the front's when it serves (it reads the files); Granian's only without it.
        ssl_cert=settings.tls_cert if front is None else None,
        ssl_key=settings.tls_key if front is None else None,
        log_level=settings.log_level,  # type: ignore[arg-type]
    )
    # What starts beside the server (the front, the local node) starts once Granian has forked
    # its worker from this process: a thread inside an import (httpx imports httpcore on a
    # client's first use), OpenSSL or a log handler at that instant leaves its lock held for
    # ever in the worker (the likely cause of a worker that never started, seen twice on one CI
    # run; not reproduced in 25 starts under load, the window is narrow), and the worker holds
    # no copy of the front's standard input, whose end stops the front. The local node's
    # children start once the server answers; they stop when it has stopped (a signal, Ctrl-C
    # included, ends serve()), or when the start fails.
    forked = threading.Event()
    os.register_at_fork(after_in_parent=forked.set)
    if front is not None:
        threading.Thread(
            target=_start_front, args=(front, forked), name="gateway-front", daemon=True
        ).start()
    try:
        if local_node is not None:
            try:
                local_node.start(not_before=forked)
            except LocalNodeError as exc:
                _die(EXIT_CONFIG, str(exc))
        server.serve()
    finally:
        if local_node is not None:
            local_node.stop()
        if front is not None:
            front.stop()


def _native_front(settings: Settings) -> NativeFront | None:
    """The native gateway front for this start (`native_front.py`), or None (the reason logged)."""
    reason = why_not(settings)
    if reason is not None:
        # Chosen (`python`), it is said once; a peer address keeping it there is a warning.
        level = logging.INFO if settings.gateway_front == "python" else logging.WARNING
        log.log(level, "the gateway runs in Python, not in the native front: %s", reason)
        return None
    try:
        front = NativeFront(settings)
    except FrontUnavailable as exc:
        _die(EXIT_CONFIG, str(exc))
    front.prepare()
    return front


def _start_front(front: NativeFront, forked: threading.Event) -> None:
    forked.wait()
    front.start()


def _die(code: int, message: str) -> None:
    print(f"modelforge-control-plane: {message}", file=sys.stderr)
    raise SystemExit(code)
