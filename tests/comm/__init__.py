"""Tests of fczero/comm/."""
