-- DatabaseNowSQL reads the database's clock.
SELECT clock_timestamp()
