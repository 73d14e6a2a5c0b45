"""`modelforge_provision_requests_outstanding{provisioner, profile}` (OB-1, PV-1): requests
submitted but not attached yet, per profile, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy.orm import Session, sessionmaker

from control_plane.provisioning.provisioner import Provisioner


class ProvisioningCollector:
    def __init__(self, provisioner: Provisioner, session_factory: sessionmaker[Session]) -> None:
        self._provisioner = provisioner
        self._session_factory = session_factory

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        if self._provisioner.provisioners:
            with self._session_factory() as session:
                counts = self._provisioner.outstanding(session)
            for (provisioner, profile), count in sorted(counts.items()):
                family.add_metric([provisioner, profile], count)
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "modelforge_provision_requests_outstanding",
            "Slurm provision requests submitted and not attached yet, per profile (at most one).",
            labels=["provisioner", "profile"],
        )
