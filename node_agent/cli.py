"""`python3 -m node_agent`: validate configuration, run the NVIDIA preflight, then the agent.

Exit codes: 0 stopped by a signal or idle for its maximum idle time, 2 configuration or state
volume, 3 preflight failed, 4 credential revoked or rejected, 5 protocol refused (426),
6 enrollment refused.

What the node offers and its idle exit come from `MODELFORGE_AGENT_PARALLEL`, `_CPUS`, `_GPUS`,
`_RAM_MB` and `_MAX_IDLE_SECONDS` (node_agent.config); a flag given overrides its variable. So
does `--python` `MODELFORGE_AGENT_PYTHON`, the interpreter Python jobs run under, checked here
before anything is sent (node_agent.job_python).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TypeVar

from pydantic import ValidationError

from modelforge_contracts.settings_errors import describe_validation_error
from node_agent import AGENT_VERSION
from node_agent.agent import Agent
from node_agent.client import connect
from node_agent.config import AgentSettings, ConfigError, PreflightSettings, url_problems
from node_agent.hardening import make_undumpable
from node_agent.identity import IdentityStore, StateVolumeError
from node_agent.inventory import Overrides
from node_agent.job_python import check_job_python
from node_agent.preflight import EXIT_PREFLIGHT, run_preflight
from node_agent.retry import EXIT_CONFIG, AgentStopped
from node_agent.tunnel import check_relay

log = logging.getLogger("modelforge.node_agent")
T = TypeVar("T")


def _positive(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return number


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number of seconds") from None
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError("must be 0 or more seconds")
    return number


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m node_agent",
        description="ModelForge node agent (configured by MODELFORGE_AGENT_* variables).",
    )
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="run only the bounded NVIDIA preflight (no network), exit 0 or 3",
    )
    parser.add_argument("--json", action="store_true", help="with --preflight: print JSON")
    # Each default is None: unset, the MODELFORGE_AGENT_* variable (or detection) decides.
    parser.add_argument(
        "--cpus", type=_positive, help="advertise this many CPUs (MODELFORGE_AGENT_CPUS)"
    )
    parser.add_argument(
        "--gpus",
        type=_positive,
        help="advertise at most this many GPUs, 0: none (MODELFORGE_AGENT_GPUS)",
    )
    parser.add_argument(
        "--ram-mb", type=_positive, help="advertise this much memory (MB) (MODELFORGE_AGENT_RAM_MB)"
    )
    parser.add_argument(
        "--parallel",
        type=_positive,
        help="run at most this many jobs at once (MODELFORGE_AGENT_PARALLEL, default 1)",
    )
    parser.add_argument(
        "--max-idle-seconds",
        type=_seconds,
        help="exit (code 0) after this long with no job or service, 0: never "
        "(MODELFORGE_AGENT_MAX_IDLE_SECONDS, default 0)",
    )
    parser.add_argument(
        "--python",
        type=Path,
        help="the Python interpreter jobs run under, e.g. a virtual environment's bin/python "
        "(MODELFORGE_AGENT_PYTHON; default: the runtime worker's own)",
    )
    parser.add_argument(
        "--artifact-url",
        help="where artifacts are uploaded and downloaded: an artifact host near their storage "
        "(MODELFORGE_AGENT_ARTIFACT_URL; default: the control plane)",
    )
    parser.add_argument("--version", action="version", version=AGENT_VERSION)
    return parser.parse_args(argv)


def _die(code: int, message: str) -> int:
    print(f"node-agent: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    # First: the environment may hold the enrollment token, and soon memory the credential.
    make_undumpable()
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    if args.preflight:
        return _preflight_only(args.json)
    try:
        settings = AgentSettings()
    except ValidationError as exc:
        return _die(
            EXIT_CONFIG, "invalid configuration:\n" + describe_validation_error(exc, AgentSettings)
        )
    logging.getLogger().setLevel(settings.log_level.upper())
    if not settings.tls_verify:
        for _ in range(3):
            log.warning(
                "!!! MODELFORGE_AGENT_TLS_VERIFY=false: the control plane's certificate is NOT "
                "verified; anyone on the path can impersonate it and take this node's "
                "credential. Use MODELFORGE_AGENT_CA_CERT_PATH instead. !!!"
            )
    python = _first(args.python, settings.python)
    if python is not None:
        try:
            version = check_job_python(python)
        except ConfigError as exc:
            return _die(EXIT_CONFIG, str(exc))
        settings = settings.model_copy(update={"python": python})
        log.info("Python jobs run under %s (Python %d.%d)", python, *version)
    if args.artifact_url is not None:
        problems = url_problems(args.artifact_url, settings.allow_insecure_http, "--artifact-url")
        if problems:
            return _die(EXIT_CONFIG, "; ".join(problems))
        settings = settings.model_copy(update={"artifact_url": args.artifact_url.rstrip("/")})
    if settings.artifact_url is not None:
        log.info("artifacts are uploaded to and downloaded from %s", settings.artifact_url)
    store = IdentityStore(settings.state_volume)
    try:
        store.check_writable()
        check_relay()
    except (StateVolumeError, ConfigError) as exc:
        return _die(EXIT_CONFIG, str(exc))

    result = run_preflight(settings.accelerator_mode, timeout=settings.preflight_timeout_seconds)
    if not result.ok:
        # Nothing has been sent: no enrollment, no empty inventory, no invented telemetry.
        return _die(EXIT_PREFLIGHT, f"{result.code}: {result.message}. {result.next_step}")
    log.info("preflight passed (mode %s, %d GPU(s))", result.mode, len(result.gpus))

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    offer = node_offer(args, settings)
    control_plane = connect(
        settings.control_plane_url,
        tls_verify=settings.tls_verify,
        ca_cert_path=settings.ca_cert_path,
        timeout=settings.request_timeout_seconds,
        stop=stop,
        artifact_url=settings.artifact_url,
    )
    try:
        with control_plane:
            Agent(
                settings=settings,
                preflight=result,
                store=store,
                control_plane=control_plane,
                overrides=offer.overrides,
                stop=stop,
                parallel=offer.parallel,
                max_idle_seconds=offer.max_idle_seconds,
            ).run()
    except AgentStopped as exc:
        return _die(exc.exit_code, exc.explanation)
    except (StateVolumeError, ConfigError) as exc:
        return _die(EXIT_CONFIG, str(exc))
    return 0


@dataclass(frozen=True)
class NodeOffer:
    """What the node offers and how long it may idle: each flag given, else its variable."""

    overrides: Overrides
    parallel: int
    max_idle_seconds: float


def node_offer(args: argparse.Namespace, settings: AgentSettings) -> NodeOffer:
    return NodeOffer(
        overrides=Overrides(
            cpus=_first(args.cpus, settings.cpus),
            gpus=args.gpus,
            ram_mb=_first(args.ram_mb, settings.ram_mb),
            gpus_variable=settings.gpus,  # below SLURM_GPUS_ON_NODE (node_agent.inventory)
        ),
        # `--parallel 0` has always meant one slot; the variable refuses 0.
        parallel=max(1, args.parallel) if args.parallel is not None else settings.parallel,
        max_idle_seconds=_first(args.max_idle_seconds, settings.max_idle_seconds),
    )


def _first(flag: T | None, variable: T) -> T:
    """The flag when it was given, else the variable's value."""
    return flag if flag is not None else variable


def _preflight_only(as_json: bool) -> int:
    try:
        settings = PreflightSettings()
    except ValidationError as exc:
        return _die(
            EXIT_CONFIG,
            "invalid configuration:\n" + describe_validation_error(exc, PreflightSettings),
        )
    result = run_preflight(settings.accelerator_mode, timeout=settings.preflight_timeout_seconds)
    print(json.dumps(result.as_json()) if as_json else result.report())
    return 0 if result.ok else EXIT_PREFLIGHT
