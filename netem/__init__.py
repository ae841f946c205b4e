"""Link shaping: link profiles compiled to tc plans, applied, read back, verified and undone."""
