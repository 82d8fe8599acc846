"""Tests of fczero/core/."""
