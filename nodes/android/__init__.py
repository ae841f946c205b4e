"""Android phones, reached with adb from their USB host: adb itself and the battery's formats
(``dumpsys battery``, the sysfs files, vendors' current conventions). The battery source is
:mod:`nodes.telemetry.battery`, the power driver (CPU frequency policies) :mod:`nodes.power.android`."""
