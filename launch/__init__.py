"""The slidedp-launch and slidedp-store CLIs (installed as slidedp.launch)."""
