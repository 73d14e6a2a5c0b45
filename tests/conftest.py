"""Shared fixtures: every database-backed test runs on SQLite and on a real PostgreSQL.

PostgreSQL comes from MODELFORGE_TEST_POSTGRES_URL (default: the local server on 127.0.0.1:5432).
If it cannot be reached the PostgreSQL tests fail with the reason: they are never skipped.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from xdist.scheduler import LoadFileScheduling

from control_plane.db import make_engine, migrate
from control_plane.models import Base
from tests.factories import ADMIN_TOKEN

POSTGRES_ADMIN_URL = os.environ.get(
    "MODELFORGE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
#: Every table of the schema: emptied between tests on the shared PostgreSQL database.
_TABLES = [table.name for table in Base.metadata.sorted_tables]


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this test session, dropped at the end."""
    name = f"modelforge_test_{secrets.token_hex(4)}"
    try:
        admin = psycopg.connect(_libpq(POSTGRES_ADMIN_URL), autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL is required for these tests and is unreachable at "
            f"MODELFORGE_TEST_POSTGRES_URL ({exc}). Start it (see .ci/run).",
            pytrace=False,
        )
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    engine = make_engine(url)
    migrate(engine)
    engine.dispose()
    try:
        yield url
    finally:
        with psycopg.connect(_libpq(POSTGRES_ADMIN_URL), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _truncate(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(_TABLES)} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Run the test once per supported database, each time on an empty schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'cp.db'}"
    url: str = request.getfixturevalue("postgres_url")
    _truncate(url)
    return url


@pytest.fixture
def pg_database_url(postgres_url: str) -> str:
    """PostgreSQL only: for behaviour that needs several processes on one database."""
    _truncate(postgres_url)
    return postgres_url


@pytest.fixture
def admin_token() -> str:
    return ADMIN_TOKEN


#: Tests that run alone, after the parallel run (`make test`), marked `alone`: those that hold a
#: measured time or rate to a bound (a latency, a backoff's sequence of waits, a rate limiter's
#: rate, CPU time), where no other test's processes may take the two cores from under them.
_ALONE = (
    "tests/e2e/test_burst.py::",
    "tests/e2e/test_tunnel_floods.py::",
    "tests/runtime_worker/test_grpc_floods.py::",
    "tests/e2e/test_gpu_health.py::test_xid79_reaches_the_control_plane_within_2_s_p99",
    "tests/runtime_worker/test_serving.py::test_100_sequential_requests_on_one_kept_alive",
    "tests/runtime_worker/test_serving_hostile.py::test_clients_slow_to_send_large_bodies_leave",
    "tests/runtime_worker/test_serving_hostile.py::test_slow_clients_holding_200_connections_cost",
    "tests/e2e/test_node_agent.py::test_control_plane_outage_backs_off_and_recovers",
    "tests/e2e/test_node_agent.py::test_an_incompatible_runtime_worker_marks_the_node",
    # Two control planes forwarding to each other (the Python gateway's peer path): under the
    # parallel run's load a readiness wait or a retry ran out now and then (two of five CI
    # replicas, stops 48 and 49), never alone; the one-data-path issue replaces this path.
    "tests/e2e/test_gateway_peers.py::",
)


#: Files that share one machine-wide resource: in the parallel run they make one unit of work,
#: run on one worker one file after another. The Slurm cluster of scripts/ensure-slurm: each of
#: these files' tests cancels every job of its one user.
_SHARING = {
    "tests/e2e/test_console_browser.py": "slurm cluster",
    "tests/e2e/test_provisioning.py": "slurm cluster",
    "tests/e2e/test_slurm_cluster.py": "slurm cluster",
    # make e2e: the two modules that load and start the shared release (conftest.release_bundle,
    # built once per worker) on one worker; test_images builds its own on the other.
    "tests/e2e_docker/test_jobs_in_containers.py": "release bundle",
    "tests/e2e_docker/test_release_docker.py": "release bundle",
}

#: Units of work handed out first, whatever their number of tests (the rest go by their number
#: of tests, most first, as xdist's loadfile does): the Slurm files together take about five
#: minutes on CI's two cores, and last in the queue they would end the run five minutes after
#: everything else. Only these: all the long fleets started at once (longest first for
#: every unit) loaded the machine so that 30 s waits ran out.
_FIRST = ("slurm cluster",)


class _FileScheduling(LoadFileScheduling):
    """xdist's `--dist loadfile` (each file's tests on one worker, in their order, its module
    fixtures built once), but for `_SHARING`'s files, one unit together, handed out first."""

    #: Whether the queue of units has been put in its order (once, before the first is sent).
    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return _SHARING.get(path, path)

    def _assign_work_unit(self, node: Any) -> None:
        # The units are queued (`schedule`) before the first is handed out: order them once.
        # Only the queue: the collection's order is the workers' own, which the tests sent are
        # indexes into.
        if not self._ordered:
            self._ordered = True
            units = sorted(
                self.workqueue.items(),
                key=lambda unit: (unit[0] not in _FIRST, -len(unit[1])),
            )
            self.workqueue.clear()
            self.workqueue.update(units)
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadFileScheduling | None:
    if config.getvalue("dist") != "loadfile":
        return None  # another --dist asked for: xdist's own
    return _FileScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`_ALONE`'s tests are marked `alone` (before `-m` selects). The parallel run
    (`pytest -n 4 --dist loadfile`) gives each file's tests to one worker, so a module's fixtures
    (a fleet, a live server) are built once and its tests run in their order."""
    for item in items:
        if item.nodeid.startswith(_ALONE):
            item.add_marker(pytest.mark.alone)
