"""A campaign script stopped on purpose, as bench/campaign_reproduction.py is when SIGTERM reaches its
`testbed run`: it exits 130 (tests/test_reproduction.py runs it as a resumable experiment)."""

raise SystemExit(130)
