"""Evolving Infra services: bus adapter, pure decision cores and their service adapters."""
