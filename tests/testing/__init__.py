"""Tests of the harnesses in fczero/testing/."""
