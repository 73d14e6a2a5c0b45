"""Who may use the admin API: the admin token and the console's sign-in sessions; and who may
read the metrics: the metrics token (`GET /metrics` only)."""
