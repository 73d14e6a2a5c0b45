"""Control plane logic. Services take a session and keyword arguments, raise `ModelForgeError`,
and never import FastAPI or make network calls inside a transaction."""
