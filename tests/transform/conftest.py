import pytest


@pytest.fixture(autouse=True)
def _check_well_formed_around_passes(well_formed_checks):
    """Every test of a pass checks the IR is well formed before and after each pass it runs."""
    yield
