"""HTTP transport only: one router per resource (`services`, `models`, `secrets`, `audit`,
`jobs`, `admin`: nodes and enrollments, …); each route parses, makes one call into its domain
with keyword arguments and returns a schema. No query and no business rule (filters,
permissions, state checks) lives here, and nothing here ever echoes a secret."""
