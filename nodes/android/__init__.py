"""Android phones, reached with adb from their USB host: battery telemetry (``dumpsys battery``
and the battery's sysfs files) and CPU frequency policies as power modes."""
