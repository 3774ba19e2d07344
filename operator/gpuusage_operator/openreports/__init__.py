"""The findings published as OpenReports (openreports.io), where policy tools read them."""
