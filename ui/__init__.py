"""The browser management UI: live status, management forms, lifecycle log and playground."""
