"""The product's test set-up (quiet third-party tips, threads per pytest worker, the real-model fixture)."""

from tests.conftest import pytest_configure, smollm2  # noqa: F401
