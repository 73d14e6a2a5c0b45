"""Background loops of the control plane. Each loop is one concern with an interval and jitter,
started and stopped explicitly by the app's lifespan; a failing iteration is logged, never fatal."""
