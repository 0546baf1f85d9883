"""slidedp-hoststate: the daemon that owns a store; its logic is slidedp.store.service."""
