"""HTTP transport only: thin routers that validate, call a service with keyword arguments and
return a schema. No business rules live here, and nothing here ever echoes a secret."""
