#!/bin/sh
# The shell of an emulated phone (hil-testbed): what `adb -s SERIAL shell CMD` runs on the phone, after
# the stand-in adb on its USB host has carried CMD here over ssh. CMD runs in this machine's sh with:
# - getprop answering from the phone's model ($TESTBED_PHONE_* set by `testbed emulate up`), and
#   ro.hil_testbed.standin = 1, so that readers label the phone's data modeled;
# - the phone's filesystem: every absolute /sys/ path in CMD is rewritten to $TESTBED_STANDIN_ROOT/sys/,
#   where `testbed emulate up` laid out the phone's cpufreq, battery and thermal files (the battery
#   files are kept up to date from the power model by the phone's battery process);
# - su: `su -c 'COMMAND'` (Magisk's form) runs COMMAND the same way, as "root"; afterwards the phone's
#   power mode follows what the cpufreq files now say (a governor change moves the CPU quota);
# - dumpsys: `dumpsys battery`, printed as Android 14's BatteryService prints it.
set -u
phone_root=${TESTBED_STANDIN_ROOT:?not an emulated phone}
on_phone() {
  printf '%s' "$1" | sed -E "s#(^|[^[:alnum:]_.~/-])/sys/#\\1$(printf '%s' "$phone_root" | sed 's/[\\#&]/\\&/g')/sys/#g"
}
getprop() {
  case "${1:-}" in
    ro.product.model) echo "${TESTBED_PHONE_MODEL:-}" ;;
    ro.product.device) echo "${TESTBED_PHONE_DEVICE:-}" ;;
    ro.build.version.release) echo "${TESTBED_PHONE_ANDROID:-14}" ;;
    ro.product.cpu.abi) echo arm64-v8a ;;
    ro.hil_testbed.standin) echo 1 ;;
    *) echo ;;
  esac
}
su() {
  if [ $# -ne 2 ] || [ "$1" != -c ]; then
    echo "su: this phone knows only su -c 'COMMAND'" >&2
    return 1
  fi
  (eval "$(on_phone "$2")")
  status=$?
  phone-governor-sync || true
  return $status
}
dumpsys() {
  if [ "$*" != battery ]; then
    echo "dumpsys: this phone knows only 'dumpsys battery'" >&2
    return 1
  fi
  battery=$phone_root/sys/class/power_supply/battery
  case "$(cat "$battery/status")" in
    Charging) status=2 ;;
    Discharging) status=3 ;;
    "Not charging") status=4 ;;
    Full) status=5 ;;
    *) status=1 ;;
  esac
  echo "Current Battery Service state:"
  echo "  AC powered: false"
  echo "  USB powered: false"
  echo "  Wireless powered: false"
  echo "  Dock powered: false"
  echo "  Max charging current: 0"
  echo "  Max charging voltage: 0"
  echo "  Charge counter: $(cat "$battery/charge_counter" 2>/dev/null || echo 0)"
  echo "  status: $status"
  echo "  health: 2"
  echo "  present: true"
  echo "  level: $(cat "$battery/capacity")"
  echo "  scale: 100"
  echo "  voltage: $(( $(cat "$battery/voltage_now") / 1000 ))"
  echo "  temperature: $(cat "$battery/temp")"
  echo "  technology: Li-ion"
}
eval "$(on_phone "$*")"
