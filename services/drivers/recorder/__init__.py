"""The recorder service, `evolving verify`, `evolving sql`."""
