"""Layer 3, the drivers: the services table, `evolving serve` / `up`, chaos, the recorder service, the gateway, the benches and the `evolving` CLI."""
