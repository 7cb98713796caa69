"""References, oracles and fixtures shared by the tests: plain modules (not test_*.py), so no test
module imports another."""
