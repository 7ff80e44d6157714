"""The embedded demo: a synthetic verifiable task and a tiny model made locally."""
