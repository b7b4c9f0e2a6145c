"""Running as a service: config, logging, journald, sd_notify."""
