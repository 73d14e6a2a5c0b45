"""ModelForge node agent: outbound-only; enrolls once, reports inventory and telemetry, claims work.

It must never open an inbound port, log its credential or enrollment token, or send fabricated
telemetry. (Built by the node agent issue; this package holds nothing executable yet.)
"""
