"""The router's routes, one module per resource (as the server's `routes/`)."""
