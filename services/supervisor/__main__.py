from reinforce.supervisor.main import main

main()
