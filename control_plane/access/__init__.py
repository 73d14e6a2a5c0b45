"""Who may use the admin API: the admin token and the console's sign-in sessions."""
