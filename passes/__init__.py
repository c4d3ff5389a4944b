"""vlmc's graph passes, one per module; each registers itself with vlmc.pass_api.register."""
