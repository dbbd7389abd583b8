"""kvgate."""
