"""The daemons (installed as slidedp.daemons)."""
