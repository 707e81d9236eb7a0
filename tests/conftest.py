import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Prepared corpora and measured peaks go to a per-session folder, shared with spawned ranks."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PARALM_CACHE", str(tmp_path_factory.mktemp("paralm-cache")))
    yield
    mp.undo()
